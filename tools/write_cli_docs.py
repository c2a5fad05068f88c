"""Write the option tables of docs/cli.md from the options' one declaration (the runners' fields and
the registered methods' config fields, `adept_ext.cli.options_table`):

    python tools/write_cli_docs.py          # rewrite docs/cli.md's tables
    python tools/write_cli_docs.py --check  # exit 1 when they differ from the declarations

Each table sits between `<!-- options: COMMAND -->` and `<!-- /options -->`.
"""
import argparse
import re
import sys
from pathlib import Path

from adept_ext.cli import options_table

PAGE = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
BLOCK = re.compile(r"(<!-- options: (\w+) -->\n)(.*?)(<!-- /options -->)", re.S)


def written(text: str) -> str:
    """`text` (docs/cli.md) with every option table replaced by the generated one."""
    return BLOCK.sub(lambda m: m.group(1) + options_table(m.group(2)) + m.group(4), text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that the tables are up to date")
    args = parser.parse_args()
    text = PAGE.read_text()
    if not BLOCK.search(text):
        raise SystemExit(f"{PAGE}: no <!-- options: COMMAND --> block")
    new = written(text)
    if args.check:
        if new != text:
            print(f"{PAGE} is out of date: run python tools/write_cli_docs.py")
            return 1
        return 0
    PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
