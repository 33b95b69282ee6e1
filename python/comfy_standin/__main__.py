"""Command line: python -m comfy_standin."""

import sys


def main(argv=None):
    print("comfy_standin", __import__("comfy_standin").__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
