"""
The store's objects, indexed the way an apiserver's reads need them, so that a list, a watch's
initial state or a garbage-collection pass costs what it touches and not the whole cluster: by
resource and namespace (list, namespace termination), by uid (owner checks) and by owner uid
(dependents). A mutable mapping from ``(group, plural, namespace, name)`` to the stored object;
every write goes through ``__setitem__``/``__delitem__``, which keep the indexes in step.
"""
from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

Key = tuple[str, str, str, str]  # (group, plural, namespace or '', name)


class Objects(MutableMapping[Key, dict[str, Any]]):
    def __init__(self) -> None:
        self._all: dict[Key, dict[str, Any]] = {}
        self._by_resource: dict[tuple[str, str], dict[str, dict[Key, dict[str, Any]]]] = {}
        self._by_namespace: dict[str, set[Key]] = {}
        self._by_uid: dict[str, Key] = {}
        self._by_owner: dict[str, set[Key]] = {}

    # --- the mapping -------------------------------------------------------------------------------

    def __getitem__(self, key: Key) -> dict[str, Any]:
        return self._all[key]

    def __setitem__(self, key: Key, obj: dict[str, Any]) -> None:
        if key in self._all:
            self._unindex(key, self._all[key])
        self._all[key] = obj
        group, plural, namespace, _ = key
        self._by_resource.setdefault((group, plural), {}).setdefault(namespace, {})[key] = obj
        self._by_namespace.setdefault(namespace, set()).add(key)
        meta = obj.get('metadata') or {}
        if meta.get('uid'):
            self._by_uid[meta['uid']] = key
        for uid in _owner_uids(meta):
            self._by_owner.setdefault(uid, set()).add(key)

    def __delitem__(self, key: Key) -> None:
        self._unindex(key, self._all.pop(key))

    def __iter__(self) -> Iterator[Key]:
        return iter(self._all)

    def __len__(self) -> int:
        return len(self._all)

    def __contains__(self, key: object) -> bool:
        return key in self._all

    def _unindex(self, key: Key, obj: dict[str, Any]) -> None:
        group, plural, namespace, _ = key
        spaces = self._by_resource[(group, plural)]
        spaces[namespace].pop(key, None)
        if not spaces[namespace]:
            del spaces[namespace]
        self._by_namespace[namespace].discard(key)
        if not self._by_namespace[namespace]:
            del self._by_namespace[namespace]
        meta = obj.get('metadata') or {}
        if self._by_uid.get(meta.get('uid', '')) == key:
            del self._by_uid[meta['uid']]
        for uid in _owner_uids(meta):
            owned = self._by_owner.get(uid)
            if owned is not None:
                owned.discard(key)
                if not owned:
                    del self._by_owner[uid]

    # --- the indexed reads -------------------------------------------------------------------------

    def of(self, group: str, plural: str, namespace: str | None = None) -> list[tuple[Key, dict[str, Any]]]:
        """The objects of one resource (in one namespace, or all), in key order."""
        spaces = self._by_resource.get((group, plural), {})
        chosen = [spaces.get(namespace, {})] if namespace else list(spaces.values())
        return sorted((item for objs in chosen for item in objs.items()), key=lambda item: item[0])

    def in_namespace(self, namespace: str) -> list[Key]:
        return list(self._by_namespace.get(namespace, ()))

    def key_of_uid(self, uid: str) -> Key | None:
        return self._by_uid.get(uid)

    def owned_by(self, uid: str) -> list[Key]:
        """Keys of the objects with an ownerReference to ``uid``."""
        return sorted(self._by_owner.get(uid, ()))


def _owner_uids(meta: dict[str, Any]) -> set[str]:
    return {ref['uid'] for ref in meta.get('ownerReferences') or [] if isinstance(ref, dict) and ref.get('uid')}
