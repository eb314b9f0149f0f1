"""The Lua scripts are read from ``nanolimit/storage/redis/lua/*.lua`` (package
data, read once at import; docs/redis.md). Moving them out of the Python
source must not change a byte: a script's SHA1 is what ``EVALSHA`` names, so a
changed byte would be a new script on every server, and a changed kernel would
decide differently from the in-memory twins. No server needed."""

from __future__ import annotations

from importlib import resources

from nanolimit._shared import Algorithm
from nanolimit.storage.redis import BATCH_SCRIPTS, COMPOUND_SCRIPT, SCRIPTS

# SHA1s computed from the inline Lua strings of storage/redis.py just before
# the Lua moved into .lua files (commit 3bd93b1). They pin the move as
# byte-identical; a deliberate change to a script updates them here, in the
# commit that changes the Lua, saying why.
SINGLE_SHA = {
    Algorithm.TOKEN_BUCKET: "a839467526f658dea4aa4eb15965a063e0cd81ff",
    Algorithm.LEAKY_BUCKET: "2b49e20f34ee7bfae4b403fe1ce43d50c0b9bcf2",
    Algorithm.FIXED_WINDOW: "c24134e1a0243a9e7b8b43f17774373fbfe56123",
    Algorithm.SLIDING_COUNTER: "99f290e69c0dde6a46b306d213a8be6049849e47",
    Algorithm.GCRA: "c178c60ba4458bab26c6a340a41533a07938c55c",
    Algorithm.SLIDING_LOG: "317f3a244008d954de97b8e6d16c82147a96f156",
}
BATCH_SHA = {
    Algorithm.TOKEN_BUCKET: "c68a3d215af9d456bc2f472807a8ff52ffccd7a0",
    Algorithm.LEAKY_BUCKET: "386be8cb27d6e8068a100d34050568308eac9eb3",
    Algorithm.FIXED_WINDOW: "007b3f638e75381d3c1bb6cf3e8f68ff612c3498",
    Algorithm.SLIDING_COUNTER: "f3afd992f54507f3e54feeb68aeb73b0a522083d",
    Algorithm.GCRA: "17026837a01f7f9feb60b9a388e2f1c52bc2ec7f",
    Algorithm.SLIDING_LOG: "2a56799ab87b437764544774cd3f70da48551c93",
}
COMPOUND_SHA = "2fbd2e90be896d15ed1a08acad0487383f8e5f1d"


def test_single_decision_scripts_are_unchanged() -> None:
    assert {algo: script.sha for algo, script in SCRIPTS.items()} == SINGLE_SHA


def test_batch_scripts_are_unchanged() -> None:
    assert {algo: script.sha for algo, script in BATCH_SCRIPTS.items()} == BATCH_SHA


def test_compound_script_is_unchanged() -> None:
    assert COMPOUND_SCRIPT.sha == COMPOUND_SHA


def test_every_placeholder_is_filled_and_every_file_is_used() -> None:
    """No ``@NAME@`` reaches a server, and no .lua file ships unused (a
    kernel file the scripts forgot would be dead package data)."""
    sources = [s.source for s in (*SCRIPTS.values(), *BATCH_SCRIPTS.values(), COMPOUND_SCRIPT)]
    assert not any("@" in source for source in sources)
    lua = resources.files("nanolimit.storage.redis").joinpath("lua")
    names = sorted(entry.name for entry in lua.iterdir() if entry.name.endswith(".lua"))
    assert names == sorted(
        [f"{algo.value}.lua" for algo in Algorithm]
        + ["prelude.lua", "error_text.lua", "single_main.lua", "batch_main.lua", "compound_main.lua"]
    )
    whole = COMPOUND_SCRIPT.source
    for name in names:
        text = lua.joinpath(name).read_text(encoding="utf-8")
        if "@" not in text:  # the mains and the prelude are filled in per script
            assert text in whole or any(text in s for s in sources), name
