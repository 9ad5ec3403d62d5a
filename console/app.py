"""nanoserve-console: the operator's terminal app (not built yet; `nanoserve generate --chat` is the interim)."""

import sys


def main() -> int:
    print(
        "nanoserve-console is not available in this version; use `nanoserve generate --chat` "
        "to chat with a model, or `nanoserve --help`.",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
