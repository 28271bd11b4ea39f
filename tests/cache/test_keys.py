"""Namespace digests (R5), chained block keys (R4) and fast-key collisions."""

import dataclasses
import random

import pytest

from kvpage.cache import BlockKeyChain, CacheNamespace, CorruptionEvent, canonical_config
from kvpage.cache import key_chain as key_chain_mod
from kvpage.errors import InvalidRequest

BASE = CacheNamespace(
    model_revision="llama@abc", tokenizer_revision="tok@def", adapter=None,
    rope_config=canonical_config({"rope_theta": 10000.0}), kv_dtype="float16",
    kv_layout_version=1, block_size=16, cache_salt=None,
)
CHANGES = {
    "model_revision": "llama@abd",
    "tokenizer_revision": "tok@deg",
    "adapter": "lora-a",
    "rope_config": canonical_config({"rope_theta": 500000.0}),
    "kv_dtype": "bfloat16",
    "kv_layout_version": 2,
    "block_size": 32,
    "cache_salt": "tenant-1",
}


def test_every_field_changes_the_digest():
    init_fields = {f.name for f in dataclasses.fields(CacheNamespace) if f.init}
    assert set(CHANGES) == init_fields  # a new field must be added to this test
    digests = {BASE.digest()}
    for name, value in CHANGES.items():
        d = dataclasses.replace(BASE, **{name: value}).digest()
        assert d not in digests, name
        digests.add(d)


def test_equal_fields_equal_digest():
    same = CacheNamespace(**{f.name: getattr(BASE, f.name)
                             for f in dataclasses.fields(CacheNamespace) if f.init})
    assert same == BASE and same.digest() == BASE.digest() and len(BASE.digest()) == 32


def test_none_and_empty_are_different():
    assert BASE.digest() != dataclasses.replace(BASE, adapter="").digest()
    assert BASE.digest() != BASE.with_salt("").digest()


def test_no_concatenation_ambiguity():
    a = dataclasses.replace(BASE, model_revision="ab", tokenizer_revision="c")
    b = dataclasses.replace(BASE, model_revision="a", tokenizer_revision="bc")
    assert a.digest() != b.digest()


def test_adapter_x_is_not_salt_x():
    assert (dataclasses.replace(BASE, adapter="X").digest()
            != dataclasses.replace(BASE, cache_salt="X").digest())


def test_int_and_string_fields_do_not_alias():
    with pytest.raises(InvalidRequest):
        dataclasses.replace(BASE, kv_layout_version="1")


def test_canonical_config_ignores_key_order():
    assert canonical_config({"a": 1, "b": 2}) == canonical_config({"b": 2, "a": 1})


# --- key chain --------------------------------------------------------------------------------
def test_chain_keys_cover_the_whole_prefix():
    ns = BASE.digest()
    c1 = BlockKeyChain(ns, 4)
    c1.extend([1, 2, 3, 4, 5, 6, 7, 8])
    c2 = BlockKeyChain(ns, 4)
    c2.extend([9, 9, 9, 9, 5, 6, 7, 8])
    assert c1.keys[1].digest != c2.keys[1].digest  # same block tokens, different prefix
    c3 = BlockKeyChain(dataclasses.replace(BASE, cache_salt="s").digest(), 4)
    c3.extend([1, 2, 3, 4])
    assert c3.keys[0] != c1.keys[0]


def test_extend_is_incremental_and_only_hashes_new_full_blocks(monkeypatch):
    calls = []
    real = key_chain_mod.chain_digest
    monkeypatch.setattr(key_chain_mod, "chain_digest",
                        lambda prev, toks: calls.append(len(toks)) or real(prev, toks))
    tokens = list(range(37))
    whole = BlockKeyChain(BASE.digest(), 4)
    whole.extend(tokens)
    assert len(whole.keys) == 9 and whole.num_tokens == 37 and calls == [4] * 9
    calls.clear()
    inc = BlockKeyChain(BASE.digest(), 4)
    for t in tokens:
        inc.extend([t])
    assert inc.keys == whole.keys and calls == [4] * 9  # one hash per completed block, no rehash
    twin = inc.copy()
    twin.extend([1, 2, 3])
    assert len(twin.keys) == 10 and len(inc.keys) == 9


def test_fast_key_is_masked():
    c = BlockKeyChain(BASE.digest(), 2, fast_key_bits=8)
    c.extend(list(range(200)))
    assert all(0 <= k.fast < 256 for k in c.keys)
    with pytest.raises(ValueError):
        BlockKeyChain(BASE.digest(), 2, fast_key_bits=65)


# --- collisions -------------------------------------------------------------------------------
def test_colliding_fast_keys_never_share_a_block(make_harness, make_ns):
    bs = 4
    h = make_harness(num_blocks=700, block_size=bs, fast_key_bits=8)
    namespace = make_ns(block_size=bs)
    rng = random.Random(0)
    owner_of_fast: dict[int, bytes] = {}  # fast key -> digest that was published first
    expected_corruptions = 0
    prompts = []
    for i in range(300):
        if prompts and rng.random() < 0.3:
            first = rng.choice(prompts)[:bs]
        else:
            first = [i, i + 1, i + 2, 1000 + i]
        tokens = first + [7]
        prompts.append(tokens)
        chain = h.m.new_key_chain(namespace)
        chain.extend(tokens)
        key = chain.keys[0]
        published = owner_of_fast.get(key.fast)
        if published is not None and published != key.digest:
            expected_corruptions += 1
        s = h.prefill(i, tokens, namespace)  # asserts every slot reads back its own tokens
        assert s.cached == (bs if published == key.digest else 0)
        owner_of_fast.setdefault(key.fast, key.digest)
    assert expected_corruptions > 20  # 8-bit keys: plenty of real collisions
    assert h.m.stats.corruption_count == expected_corruptions
    events = [e for e in h.m.audit if isinstance(e, CorruptionEvent)]
    assert len(events) == expected_corruptions
    assert all(e.wanted_digest != e.found_digest for e in events)
    by_block: dict[int, list[int]] = {}
    for p_tokens, blk in zip(prompts, (h.m.live_tables[i].block_ids[0] for i in range(300)),
                             strict=True):
        by_block.setdefault(blk, []).append(tuple(p_tokens[:bs]))
    for holders in by_block.values():
        assert len(set(holders)) == 1  # a block is only ever shared by identical prefixes
