"""InfoNCE vs DCL (or any objectives) on audio-text: the CLAP recipe per objective and seed, zero-shot
intent accuracy against the untrained model, with 95 % intervals over seeds.

    python recipes/clap/compare.py --losses infonce dcl --seeds 0 1 2 --out-dir runs/clap-compare
"""

from pathlib import Path

from contrastkit.cli import one_line_errors, parse
from contrastkit.speech.clap_compare import ClapCompareArgs, compare


def main(argv=None):
    args = parse(ClapCompareArgs, description=__doc__, argv=argv)
    with one_line_errors(ValueError, FileNotFoundError):
        compare(args)
    print((Path(args.results_dir or args.out_dir) / "results.md").read_text())


if __name__ == "__main__":
    main()
