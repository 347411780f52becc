"""Test hooks: the one place where tests inject faults and shrink sizes. Not public API.

Plain module attributes, read by product code where it needs them; their defaults change
nothing. Nothing here, nor anywhere in the package, is read from the environment.

A test sets a hook in its own process (``monkeypatch.setattr(hooks, "chunk_records", 3)``). The
package's own child processes (build workers, background builds, pack planners: every
``procs.start_child``) start with the parent's values, so a hook set in a test reaches the build
or the plan it starts. A test that runs a script of its own sets the hooks there first, e.g.
``hooks.apply(json.loads(sys.argv[1]))`` with ``json.dumps(hooks.values())`` from the test.
"""

from __future__ import annotations

from typing import Any

#: build/commit: the builder SIGKILLs itself right after its N-th commit (a crash at a known
#: commit, instead of a race with a timer); 0: never
kill_after_commits: int = 0
#: format/ledger: records per index and log chunk of new caches (None: ledger.CHUNK_RECORDS),
#: small to cross chunk boundaries with a few blocks
chunk_records: int | None = None
#: read/pack_plan: blocks per pack plan chunk file (None: pack_plan.CHUNK_BLOCKS)
pack_chunk_blocks: int | None = None
#: read/pack_plan: tokens of work that justify a planning process (None: pack_plan.TOKENS_PER_CHILD)
pack_tokens_per_child: int | None = None

NAMES = ("kill_after_commits", "chunk_records", "pack_chunk_blocks", "pack_tokens_per_child")


def values() -> dict[str, Any]:
    """Every hook's current value, by name (JSON-serialisable; what a child process needs)."""
    return {name: globals()[name] for name in NAMES}


def apply(settings: dict[str, Any]) -> None:
    """Set the hooks named in `settings` (as `values()` gives them); an unknown name is an error."""
    unknown = set(settings) - set(NAMES)
    if unknown:
        raise ValueError(f"unknown test hooks {sorted(unknown)}; the hooks are {', '.join(NAMES)}")
    globals().update(settings)
