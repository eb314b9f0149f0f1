"""The Lua scripts are read from ``nanolimit/storage/redis/lua/*.lua`` (package
data, read once at import; docs/redis.md). Moving them out of the Python
source must not change a byte: a script's SHA1 is what ``EVALSHA`` names, so a
changed byte would be a new script on every server, and a changed kernel would
decide differently from the in-memory twins. No server needed."""

from __future__ import annotations

from importlib import resources

from nanolimit._limiter_config import Algorithm
from nanolimit.storage.redis._scripts import BATCH_SCRIPTS, COMPOUND_SCRIPT, REFUND_SCRIPTS, SCRIPTS

# SHA1s computed from the inline Lua strings of storage/redis.py just before
# the Lua moved into .lua files (commit 3bd93b1). They pin the move as
# byte-identical; a deliberate change to a script updates them here, in the
# commit that changes the Lua, saying why. Changed since: every reply ends
# with the decision's time (Decision.at), and each kernel's state check moved
# into lua/<algorithm>_state.lua, which the refund scripts share.
SINGLE_SHA = {
    Algorithm.TOKEN_BUCKET: "ea1db098257c72d7ffa78771ad36817b3dc9b33d",
    Algorithm.LEAKY_BUCKET: "2568e412706d80bb147956a8e28ea73e3ce400c2",
    Algorithm.FIXED_WINDOW: "466f21fb23fd325b94c4bc5b05ce4ecad0782f12",
    Algorithm.SLIDING_COUNTER: "efa3c533dde4ee0d080ee85ddb3b71d5abb5b572",
    Algorithm.GCRA: "039fbc863cee1e700b4cde70e104b21b6a23bb5d",
    Algorithm.SLIDING_LOG: "001c193e7aecfbbfb6c6bbf6f7de3786a0e63dea",
}
BATCH_SHA = {
    Algorithm.TOKEN_BUCKET: "1ff0e42777bcb63d8f3bd92d7e5bc2efae622288",
    Algorithm.LEAKY_BUCKET: "491b565da205a0f0d60d6d1b1e76c82d38b95101",
    Algorithm.FIXED_WINDOW: "41fcee0590c9b17b8e2520904caf1199e162dda3",
    Algorithm.SLIDING_COUNTER: "29c68505e0913d19e7820ebd1f8a83b561f4c0cb",
    Algorithm.GCRA: "0576dcbb19bf44017bd5058e6efb1e5ef9a26e3c",
    Algorithm.SLIDING_LOG: "d3b1285682f9ae1490f4f4abcfee7cb06f75ad69",
}
REFUND_SHA = {
    Algorithm.TOKEN_BUCKET: "816aeb4e8338f0b8308a5c6d2f8410e3d0829c77",
    Algorithm.LEAKY_BUCKET: "8cad2c08df9e6d4879baab4504ad2949b392cf85",
    Algorithm.FIXED_WINDOW: "673b30d284b9e2b28bbe527acb3c703e633764e7",
    Algorithm.SLIDING_COUNTER: "795f4332165cd6f4c91683f9fa940b763b84b541",
    Algorithm.GCRA: "0e1c8e0432fce5ebd3c2cb37b94507d0d910335e",
    Algorithm.SLIDING_LOG: "15b2c3c14d3b868f02cd63e73df7d1f6cc5c21cf",
}
COMPOUND_SHA = "8abfe7cd83c0b5b09411b84b53fa8be49701b011"


def test_single_decision_scripts_are_unchanged() -> None:
    assert {algo: script.sha for algo, script in SCRIPTS.items()} == SINGLE_SHA


def test_batch_scripts_are_unchanged() -> None:
    assert {algo: script.sha for algo, script in BATCH_SCRIPTS.items()} == BATCH_SHA


def test_compound_script_is_unchanged() -> None:
    assert COMPOUND_SCRIPT.sha == COMPOUND_SHA


def test_refund_scripts_are_unchanged() -> None:
    assert {algo: script.sha for algo, script in REFUND_SCRIPTS.items()} == REFUND_SHA


def test_every_placeholder_is_filled_and_every_file_is_used() -> None:
    """No ``@NAME@`` reaches a server, and no .lua file ships unused (a
    kernel file the scripts forgot would be dead package data)."""
    sources = [
        s.source
        for s in (*SCRIPTS.values(), *BATCH_SCRIPTS.values(), COMPOUND_SCRIPT, *REFUND_SCRIPTS.values())
    ]
    assert not any("@" in source for source in sources)
    lua = resources.files("nanolimit.storage.redis").joinpath("lua")
    names = sorted(entry.name for entry in lua.iterdir() if entry.name.endswith(".lua"))
    assert names == sorted(
        [
            f"{algo.value}{part}.lua"
            for algo in Algorithm
            for part in ("", "_state", "_refund")
            if not (part == "_state" and algo in (Algorithm.TOKEN_BUCKET, Algorithm.LEAKY_BUCKET))
        ]
        + ["prelude.lua", "error_text.lua", "single_main.lua", "batch_main.lua", "compound_main.lua"]
        + ["refund_main.lua", "bucket_state.lua"]  # the two buckets read their state through one
    )
    whole = COMPOUND_SCRIPT.source
    for name in names:
        text = lua.joinpath(name).read_text(encoding="utf-8")
        if "@" not in text:  # the mains and the prelude are filled in per script
            assert text in whole or any(text in s for s in sources), name
