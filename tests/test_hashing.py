import hashlib
import json
import logging
import os
import subprocess
import sys
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucm.hashing import BlockHasher, HashContext

BS = 4
tokens_st = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=40)
CTX = HashContext(model="tiny-llama", dtype="float32", block_size=BS)


def hasher(**kw) -> BlockHasher:
    base = {"model": "tiny-llama", "dtype": "float32", "block_size": BS}
    return BlockHasher(HashContext(**{**base, **kw}))


@given(tokens_st, tokens_st)
def test_block_i_depends_only_on_its_prefix(a, b):
    h = BlockHasher(CTX)
    ids_a, ids_b = h.block_ids(a), h.block_ids(b)
    for i in range(min(len(ids_a), len(ids_b))):
        same_prefix = a[: (i + 1) * BS] == b[: (i + 1) * BS]
        assert (ids_a[i] == ids_b[i]) == same_prefix


@given(tokens_st)
def test_only_full_blocks_get_ids(tokens):
    assert len(BlockHasher(CTX).block_ids(tokens)) == len(tokens) // BS


@given(tokens_st, st.integers(min_value=0, max_value=10))
def test_extend_reuses_known_ids_and_matches_full_hash(tokens, cut):
    h = BlockHasher(CTX)
    full = h.block_ids(tokens)
    known = full[: min(cut, len(full))]
    assert h.extend(tokens, known) == full


@settings(max_examples=50)
@given(st.lists(st.integers(min_value=0, max_value=50_000), min_size=BS, max_size=24))
def test_salt_model_dtype_layout_give_disjoint_ids(tokens):
    variants = [
        hasher(),
        hasher(salt="tenant-a"),
        hasher(salt="tenant-b"),
        hasher(model="other-model"),
        hasher(dtype="bfloat16"),
        hasher(tp_size=2),
        hasher(algorithm="blake3"),
    ]
    id_sets = [set(v.block_ids(tokens)) for v in variants]
    for i in range(len(id_sets)):
        for j in range(i + 1, len(id_sets)):
            assert not id_sets[i] & id_sets[j]


def test_block_size_is_part_of_the_id():
    tokens = list(range(64))
    assert (
        hasher(block_size=32).block_ids(tokens)[0]
        != BlockHasher(HashContext("tiny-llama", "float32", 64)).block_ids(tokens)[0]
    )


def test_ids_agree_across_processes_with_different_hash_seeds():
    tokens = list(range(1000, 1100))
    code = (
        "import json,sys; from ucm.hashing import BlockHasher, HashContext; "
        "h=BlockHasher(HashContext('m','float16',16,salt='s')); "
        "print(json.dumps([i.hex() for i in h.block_ids(json.loads(sys.argv[1]))]))"
    )
    outputs = set()
    for seed in ("0", "1", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code, json.dumps(tokens)], env=env, capture_output=True, text=True, check=True
        ).stdout
        outputs.add(out)
    assert len(outputs) == 1
    ours = [i.hex() for i in BlockHasher(HashContext("m", "float16", 16, salt="s")).block_ids(tokens)]
    assert json.loads(outputs.pop()) == ours


def test_default_is_sha256_and_md5_warns(caplog):
    assert CTX.algorithm == "sha256"
    assert len(BlockHasher(CTX).block_ids(list(range(BS)))[0]) == 32
    with caplog.at_level(logging.WARNING, logger="ucm.hashing"):
        h = hasher(algorithm="md5")
    assert "not collision resistant" in caplog.text
    assert len(h.block_ids(list(range(BS)))[0]) == 16


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block_size": 0}, "block_size"),
        ({"tp_size": 0}, "tp_size"),
        ({"model": ""}, "model"),
        ({"algorithm": "crc32"}, "hash_algorithm"),
    ],
)
def test_bad_context_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        hasher(**kwargs)


@pytest.mark.parametrize("bad", [[-1, 0, 0, 0], [2**32, 0, 0, 0], [1.5, 0, 0, 0]])
def test_bad_tokens_are_rejected(bad):
    with pytest.raises(ValueError, match="tokens"):
        BlockHasher(CTX).block_ids(bad)


def test_a_configured_salt_and_a_request_salt_cannot_be_confused():
    """Concatenated, salt "acme" with cache_salt "-prod" was salt "acme-prod": one tenant's
    request could name another deployment's blocks."""
    context, tokens = HashContext("m", "float16", 16), list(range(64))
    split = BlockHasher(replace(context, salt="acme", request_salt="-prod")).block_ids(tokens)
    joined = BlockHasher(replace(context, salt="acme-prod")).block_ids(tokens)
    assert set(split).isdisjoint(joined)
    assert BlockHasher(replace(context, request_salt="")).block_ids(tokens) == BlockHasher(context).block_ids(tokens)


# Every field of the seed, with a value other than the base context's: each one names other KV.
_OTHER_VALUE = {
    "model": "other-model",
    "dtype": "bfloat16",
    "block_size": 2 * BS,
    "tp_size": 2,
    "salt": "tenant",
    "request_salt": "request-tenant",
    "algorithm": "blake3",
    "weights": "other-weights",
    "pp_size": 2,
    "blend": "blend-settings",
    "engine": "overrides",
    "adapter": "adapter-fingerprint",
}


def test_the_property_list_covers_every_field_of_the_seed():
    assert set(_OTHER_VALUE) == set(HashContext.__dataclass_fields__)


@settings(max_examples=60)
@given(
    st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=2 * BS, max_size=6 * BS),
    st.sets(st.sampled_from(sorted(_OTHER_VALUE)), min_size=1),
)
def test_ids_differ_whenever_any_identity_field_differs(tokens, changed):
    """Never the wrong KV: no block of one context is a block of another, whatever fields differ."""
    other = replace(CTX, **{name: _OTHER_VALUE[name] for name in changed})
    assert set(BlockHasher(CTX).block_ids(tokens)).isdisjoint(BlockHasher(other).block_ids(tokens))


@given(st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=BS, max_size=4 * BS))
def test_ids_are_equal_when_only_the_request_is_other(tokens):
    """The same context for requests of other ids, lengths or arrival: the same ids, so KV is shared
    exactly when it is the same; an empty optional field is the context without it."""
    assert BlockHasher(CTX).block_ids(tokens) == hasher().block_ids(tokens)
    assert BlockHasher(CTX.for_request()).block_ids(tokens) == BlockHasher(CTX).block_ids(tokens)
    longer = tokens + [7] * BS
    assert BlockHasher(CTX).block_ids(longer)[: len(tokens) // BS] == BlockHasher(CTX).block_ids(tokens)


def test_empty_optional_fields_leave_ids_as_they_were():
    """ids stored before a field existed are still found by engines and requests that do not use it."""
    seed = BlockHasher(CTX).seed
    fields = {k: v for k, v in vars(CTX).items() if k not in ("request_salt", "blend", "engine", "adapter")}
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    assert seed == hashlib.sha256(b"ucm-block-seed/v1\x00" + canonical.encode()).digest()
