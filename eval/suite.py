"""One command, one report across vision, image-text and speech: train small models with each objective
(or take the checkpoints named in a config), run every evaluation that fits, write report.{json,md,png}.

    python eval/suite.py                               # the default suite on the embedded data (~2 h on 2 cores)
    python eval/suite.py --config my_suite.yaml        # real data and checkpoints; see eval/suite_example.yaml
    python eval/suite.py --output-dir runs/suite       # run again: finished cells are not redone
    python eval/suite.py --domains image_text --objectives infonce dcl siglip --no-sweep \
        --reuse docs/suite_default/report.json        # the committed report's cells are not run again
"""

import json

from contrastkit.cli import parse
from contrastkit.suite import SuiteArgs, load_reused, markdown, run_suite


def main(argv=None):
    args = parse(SuiteArgs, description=__doc__, argv=argv, config_flag=False)
    config = args.resolve()
    if args.print_config:
        print(json.dumps(config, indent=2))
        return
    reuse = load_reused(args.reuse) if args.reuse else ()
    report = run_suite(config, progress=args.progress, reuse=reuse)
    print(markdown(report))
    print(f"report: {config['output_dir']}/report.md, report.json, report_domains.png")


if __name__ == "__main__":
    main()
