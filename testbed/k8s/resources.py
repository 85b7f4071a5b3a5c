"""
The served resources: built-ins (from kmock's bundled discovery dump of a real cluster) and
custom resources registered dynamically from CustomResourceDefinition objects; and the legacy
discovery documents (``/api``, ``/api/v1``, ``/apis``, ``/apis/G``, ``/apis/G/V``).
"""
import dataclasses
import gzip
import importlib.resources
import re
from typing import Any

import kmock

# Groups in kmock's bundle that are not built into a plain kube-apiserver (CRDs/aggregated in k3s).
_NOT_BUILTIN = {'gateway.networking.k8s.io', 'metrics.k8s.io'}
ALL_VERBS = ['create', 'delete', 'deletecollection', 'get', 'list', 'patch', 'update', 'watch']


@dataclasses.dataclass
class ResourceDef:
    group: str
    version: str
    plural: str
    kind: str
    singular: str
    namespaced: bool
    verbs: list[str] = dataclasses.field(default_factory=lambda: list(ALL_VERBS))
    short_names: list[str] = dataclasses.field(default_factory=list)
    categories: list[str] = dataclasses.field(default_factory=list)
    subresources: set[str] = dataclasses.field(default_factory=set)
    printer_columns: list[dict[str, Any]] | None = None  # None: a built-in (server-side printer)
    schema: dict[str, Any] | None = None  # openAPIV3Schema of a CRD version
    selectable_fields: set[str] = dataclasses.field(default_factory=set)
    scale_paths: dict[str, str] | None = None  # a CRD's subresources.scale
    custom: bool = False

    @property
    def api_version(self) -> str:
        return f'{self.group}/{self.version}' if self.group else self.version

    @property
    def group_resource(self) -> str:
        """E.g. ``configmaps`` or ``widgets.example.io`` (as in error messages)."""
        return f'{self.plural}.{self.group}' if self.group else self.plural

    @property
    def kind_group(self) -> str:
        return f'{self.kind}.{self.group}' if self.group else self.kind

    @property
    def list_kind(self) -> str:
        return f'{self.kind}List'

    def discovery(self) -> list[dict[str, Any]]:
        entry = {
            'name': self.plural, 'singularName': self.singular, 'namespaced': self.namespaced,
            'kind': self.kind, 'verbs': sorted(self.verbs),
        }
        if self.short_names:
            entry['shortNames'] = list(self.short_names)
        if self.categories:
            entry['categories'] = list(self.categories)
        entries = [entry]
        for sub in sorted(self.subresources):
            verbs = ['get', 'patch', 'update'] if sub in ('status', 'scale') else ['create', 'get']
            entries.append({'name': f'{self.plural}/{sub}', 'singularName': '', 'namespaced': self.namespaced,
                            'kind': 'Scale' if sub == 'scale' else self.kind, 'verbs': verbs})
        return entries


def version_priority(version: str) -> tuple[int, int, int]:
    """Kubernetes version ordering: GA > beta > alpha, bigger numbers first (as a sort key)."""
    m = re.fullmatch(r'v(\d+)(?:(alpha|beta)(\d+))?', version)
    if not m:
        return (3, 0, 0)  # non-conforming versions go last
    major, stage, minor = int(m.group(1)), m.group(2), int(m.group(3) or 0)
    return ({None: 0, 'beta': 1, 'alpha': 2}[stage], -major, -minor)


class Registry:
    def __init__(self) -> None:
        self.defs: dict[tuple[str, str, str], ResourceDef] = {}
        bundle = kmock.ResourcesArray()  # == bundle.load_bundled(), without its DeprecationWarning
        bundle.load_data(gzip.decompress(importlib.resources.files('kmock._internal')
                                         .joinpath('resources.json.gz').read_bytes()))
        for res in bundle:
            info = bundle[res]
            if res.group in _NOT_BUILTIN or res.plural is None or res.group is None or res.version is None:
                continue
            kind = info.kind or res.plural.capitalize()
            self.add(ResourceDef(
                group=res.group, version=res.version, plural=res.plural, kind=kind,
                singular=info.singular or kind.lower(), namespaced=bool(info.namespaced),
                verbs=sorted(info.verbs), short_names=sorted(info.shortnames),
                categories=sorted(info.categories), subresources=set(info.subresources),
            ))

    def add(self, rd: ResourceDef) -> None:
        self.defs[(rd.group, rd.version, rd.plural)] = rd

    def get(self, group: str, version: str, plural: str) -> ResourceDef | None:
        return self.defs.get((group, version, plural))

    def versions_of(self, group: str, plural: str) -> list[ResourceDef]:
        return [rd for (g, _, p), rd in self.defs.items() if g == group and p == plural]

    def by_kind(self, api_version: str, kind: str) -> ResourceDef | None:
        for rd in self.defs.values():
            if rd.api_version == api_version and rd.kind == kind:
                return rd
        return None

    def group_versions(self) -> dict[str, list[str]]:
        result: dict[str, set[str]] = {}
        for (group, version, _) in self.defs:
            if group:
                result.setdefault(group, set()).add(version)
        return {g: sorted(vs, key=version_priority) for g, vs in sorted(result.items())}

    # --- CRDs ---------------------------------------------------------------------------------

    def register_crd(self, crd: dict[str, Any]) -> None:
        spec = crd.get('spec') or {}
        names = spec.get('names') or {}
        self.unregister_crd(crd)
        for ver in spec.get('versions') or []:
            if not ver.get('served', True):
                continue
            subresources = set((ver.get('subresources') or {}).keys())
            columns = ver.get('additionalPrinterColumns')
            if columns is None:
                columns = [{'name': 'Age', 'type': 'date', 'jsonPath': '.metadata.creationTimestamp'}]
            self.add(ResourceDef(
                group=spec['group'], version=ver['name'], plural=names['plural'], kind=names['kind'],
                singular=names.get('singular') or names['kind'].lower(),
                namespaced=spec.get('scope', 'Namespaced') == 'Namespaced',
                short_names=list(names.get('shortNames') or []), categories=list(names.get('categories') or []),
                subresources=subresources, printer_columns=list(columns),
                schema=(ver.get('schema') or {}).get('openAPIV3Schema'),
                selectable_fields={f['jsonPath'].lstrip('.') for f in ver.get('selectableFields') or []},
                scale_paths=(ver.get('subresources') or {}).get('scale'), custom=True,
            ))

    def unregister_crd(self, crd: dict[str, Any]) -> None:
        spec = crd.get('spec') or {}
        plural = (spec.get('names') or {}).get('plural')
        for key in [k for k in self.defs if k[0] == spec.get('group') and k[2] == plural]:
            del self.defs[key]

    # --- discovery documents -----------------------------------------------------------------

    def api_versions(self, server_address: str) -> dict[str, Any]:
        return {'kind': 'APIVersions', 'versions': ['v1'],
                'serverAddressByClientCIDRs': [{'clientCIDR': '0.0.0.0/0', 'serverAddress': server_address}]}

    def api_group(self, group: str) -> dict[str, Any] | None:
        versions = self.group_versions().get(group)
        if not versions:
            return None
        return {
            'kind': 'APIGroup', 'apiVersion': 'v1', 'name': group,
            'versions': [{'groupVersion': f'{group}/{v}', 'version': v} for v in versions],
            'preferredVersion': {'groupVersion': f'{group}/{versions[0]}', 'version': versions[0]},
        }

    def api_group_list(self) -> dict[str, Any]:
        groups = [self.api_group(g) for g in self.group_versions()]
        return {'kind': 'APIGroupList', 'apiVersion': 'v1', 'groups': [
            {k: v for k, v in g.items() if k not in ('kind', 'apiVersion')} for g in groups if g]}

    def resource_list(self, group: str, version: str) -> dict[str, Any] | None:
        defs = [rd for (g, v, _), rd in sorted(self.defs.items()) if g == group and v == version]
        if not defs:
            return None
        return {
            'kind': 'APIResourceList', 'apiVersion': 'v1',
            'groupVersion': f'{group}/{version}' if group else version,
            'resources': [entry for rd in defs for entry in rd.discovery()],
        }
