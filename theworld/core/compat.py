"""How long what an earlier release wrote is still read: the compatibility rules, written once (docs/training.md,
"Compatibility", says them to users). Each kind of old input has a rule and the release it came from:

- a moved config key (a command config's `MOVED`) is read under its new name, with one warning line, in the release
  that moved it and the KEY_RELEASES releases after it; after that it is refused in one line naming the new key, and
  its entry leaves `MOVED` (a test fails while an expired entry is still there);
- a run hash is permanent: a checkpoint resumes on every release that reads its format, so a key enters `run_hash`
  only away from its default, a key move hashes the earlier shape, and a shipped config's recorded hash
  (tests/configs/test_shipped_configs.py) changes only with its numbers, saying why beside it;
- a cache format (theworld/cache_format/migrations.py) and a checkpoint format (train/state/migrations.py) are read
  for FORMAT_RELEASES releases after the release whose code stopped writing them; after that they are refused in one
  line naming the version and the last release that reads it. A cache costs an encoder pass over the data set and a
  checkpoint costs the run, so formats are kept longer than key names.

Release numbers are those of docs (the fifth release is design.md's section 9); RELEASE is this code's.
"""

from __future__ import annotations

from dataclasses import dataclass

from theworld.core.errors import UserError

RELEASE = 5  # the release this code is
KEY_RELEASES = 2  # releases after its move that a moved config key is still read
FORMAT_RELEASES = 4  # releases after its successor that a cache or checkpoint format is still read

# format_version -> the release whose code first wrote it (from the commits that introduced each)
CACHE_FORMATS = {1: 1, 2: 3, 3: 3, 4: 5}
CHECKPOINT_FORMATS = {1: 1, 2: 3, 3: 5}


@dataclass(frozen=True)
class Move:
    """A config key of an earlier release: its name now and the release that moved it."""

    new: str
    release: int

    @property
    def last_read(self) -> int:
        """The last release that reads the old name."""
        return self.release + KEY_RELEASES


def moves(release: int, pairs: dict[str, str]) -> dict[str, Move]:
    """`pairs` (old dotted key -> new dotted key), all moved in `release`."""
    return {old: Move(new, release) for old, new in pairs.items()}


def refuse_expired(old: str, move: Move, release: int = RELEASE) -> None:
    """The one-line refusal of an old key name whose window has passed; nothing while it is still read."""
    if release > move.last_read:
        raise UserError(
            f"config key '{old}' is '{move.new}' since release {move.release}; release {release} no longer reads "
            f"the earlier name (read through release {move.last_read}): give {move.new}"
        )


def format_last_read(formats: dict[int, int], version: int) -> int | None:
    """The last release that reads `version` of a format whose versions began in `formats` (version -> release);
    None for the newest, which is written now."""
    later = [r for v, r in formats.items() if v > version]
    return min(later) + FORMAT_RELEASES if later else None


def readable(formats: dict[int, int], release: int = RELEASE) -> tuple[int, ...]:
    """The versions of a format that `release` reads: the newest and each earlier one within its window."""
    return tuple(v for v in sorted(formats) if (format_last_read(formats, v) or release) >= release)
