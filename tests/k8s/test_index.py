"""The store's indexes agree with a plain scan of its objects after any sequence of writes."""
import random

from testbed.k8s.index import Objects


def _obj(uid: str, owners: list[str]) -> dict:
    meta = {'uid': uid}
    if owners:
        meta['ownerReferences'] = [{'uid': o} for o in owners]
    return {'metadata': meta}


def test_indexed_reads_match_a_full_scan_after_random_writes() -> None:
    rng = random.Random(7)
    objects = Objects()
    plain: dict = {}
    resources = [('', 'configmaps'), ('apps', 'deployments'), ('', 'namespaces')]
    for step in range(3000):
        group, plural = rng.choice(resources)
        ns = '' if plural == 'namespaces' else rng.choice(['a', 'b', 'c'])
        key = (group, plural, ns, f'o{rng.randrange(40)}')
        if rng.random() < 0.3 and key in plain:
            del objects[key], plain[key]
            continue
        uids = [o['metadata']['uid'] for o in plain.values()]
        owners = rng.sample(uids, k=min(len(uids), rng.randrange(3)))
        obj = _obj(f'u{step}', owners)  # a rewrite keeps the key, gets a new uid and new owners
        objects[key] = plain[key] = obj
    assert dict(objects) == plain and len(objects) == len(plain)
    for group, plural in resources:
        for ns in (None, 'a', 'b', 'c', ''):
            expected = sorted((k, o) for k, o in plain.items() if k[:2] == (group, plural) and (not ns or k[2] == ns))
            assert objects.of(group, plural, ns) == expected
    for ns in ('a', 'b', 'c', '', 'none'):
        assert sorted(objects.in_namespace(ns)) == sorted(k for k in plain if k[2] == ns)
    for key, obj in plain.items():
        assert objects.key_of_uid(obj['metadata']['uid']) == key
    gone = {f'u{step}' for step in range(3000)} - {o['metadata']['uid'] for o in plain.values()}
    assert all(objects.key_of_uid(uid) is None for uid in gone)
    for uid in {f'u{step}' for step in range(3000)}:
        owned = sorted(k for k, o in plain.items()
                       if uid in [r['uid'] for r in o['metadata'].get('ownerReferences', [])])
        assert objects.owned_by(uid) == owned
