"""Names every installed package whose version differs from its pin in .ci/constraints.txt.

Run by .ci/setup-newest after it installed the newest release of every dependency: when the fast tier
fails there and passes on the pinned set, this list says which new releases to suspect.
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement


def pinned(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            pins[req.name.lower().replace("_", "-")] = spec.version
    return pins


def main() -> None:
    pins = pinned(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("constraints.txt"))
    installed = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in metadata.distributions()}
    drift = sorted(
        (name, installed[name], pin)
        for name, pin in pins.items()
        if name in installed and installed[name].split("+")[0] != pin
    )
    if not drift:
        print("newest releases: every pinned package is at its pin")
        return
    print(f"newest releases: {len(drift)} packages differ from .ci/constraints.txt (the pinned suite's set):")
    for name, version, pin in drift:
        print(f"  {name} {version} (pinned {pin})")


if __name__ == "__main__":
    main()
