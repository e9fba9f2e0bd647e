import os

from ace_extproc.native import chain
from ace_extproc.prefix import cache_prefix_id, hash_prompt, scope_seed


def test_prompts_share_exactly_the_full_blocks_they_share_in_text():
    base = os.urandom(5000)
    other = base[:1300] + b"X" + base[1301:]
    a, b = chain(base, 512, 7), chain(other, 512, 7)
    assert len(a) == len(b) == 9  # 5000 // 512: the partial tail is not hashed
    assert a[:2] == b[:2]  # blocks 0-1 end before byte 1300
    assert all(x != y for x, y in zip(a[2:], b[2:], strict=True))  # chained: all later differ


def test_block_hashes_are_scoped_by_seed():
    data = b"a" * 2048
    assert chain(data, 512, scope_seed("t1", "m")) != chain(data, 512, scope_seed("t2", "m"))
    assert chain(data, 512, scope_seed("t1", "m")) != chain(data, 512, scope_seed("t1", "m2"))
    assert chain(data, 512, scope_seed("t1", "m")) == chain(data, 512, scope_seed("t1", "m"))


def test_prefix_key_names_the_cacheable_prefix_only():
    prefix = b"p" * 1500
    a = hash_prompt(prefix + b"question one", 1500, 512, 1)
    b = hash_prompt(prefix + b"another question entirely" * 40, 1500, 512, 1)
    c = hash_prompt(b"q" + prefix[1:] + b"question one", 1500, 512, 1)
    assert a.prefix_key == b.prefix_key != c.prefix_key
    assert len(a.prefix_key) == 16 and int(a.prefix_key, 16) >= 0
    # The partial tail of the prefix (bytes 1024..1500) counts too.
    d = hash_prompt(prefix[:1400] + b"z" * 100 + b"question one", 1500, 512, 1)
    assert d.prefix_key != a.prefix_key


def test_plain_prompt_prefix_is_its_leading_full_blocks():
    a = hash_prompt(b"x" * 1100, None, 512, 1)
    b = hash_prompt(b"x" * 1024 + b"y" * 300, None, 512, 1)
    assert a.prefix_key == b.prefix_key == f"{a.blocks[-1]:016x}"


def test_short_prompt_has_no_blocks_but_a_route_key():
    h = hash_prompt(b"hi", 2, 512, 1)
    assert h.blocks == [] and h.route_key == int(h.prefix_key, 16)
    assert hash_prompt(b"hi", 2, 512, 1).route_key != hash_prompt(b"ho", 2, 512, 1).route_key


def test_cache_prefix_id_format():
    assert cache_prefix_id("acme", "00ff00ff00ff00ff") == "ace-kv-acme-00ff00ff00ff00ff"
