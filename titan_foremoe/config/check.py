"""Pre-flight config check: ``python -m titan_foremoe.config.check FILE --world-size N [--section.key=value ...]``.

Exit 0 and print a one-line summary when valid; exit 2 with one line naming
the key and the problem otherwise. ``run_train.sh`` runs it before torchrun.
"""

from __future__ import annotations

import sys

from .loader import ConfigError, load_config
from .validate import validate


def main(argv: list[str]) -> int:
    world_size = 1
    rest: list[str] = []
    path = None
    i = 0
    while i < len(argv):
        if argv[i] == "--world-size":
            world_size = int(argv[i + 1])
            i += 2
            continue
        if path is None and not argv[i].startswith("--"):
            path = argv[i]
        else:
            rest.append(argv[i])
        i += 1
    try:
        r = validate(load_config(path, rest), world_size)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(
        f"config ok: world={r.world_size} dp_shard={r.dp_shard} ep={r.ep} "
        f"experts={r.num_experts} top_k={r.top_k} micro_steps={r.micro_steps}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
