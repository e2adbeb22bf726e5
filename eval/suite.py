"""One command, one report across vision, image-text and speech: train small models with each objective
(or take the checkpoints named in a config), run every evaluation that fits, write report.{json,md,png}.

    python eval/suite.py                               # the default suite on the embedded data (~20 min, 2 cores)
    python eval/suite.py --config my_suite.yaml        # real data and checkpoints; see eval/suite_example.yaml
    python eval/suite.py --output-dir runs/suite       # run again: finished cells are not redone
"""

import argparse
import json

from contrastkit.suite import load_config, markdown, run_suite

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--config", help="YAML or TOML file; keys: output_dir, objectives, seeds, domains, sweep")
p.add_argument("--output-dir", help="overrides the config's output_dir")
p.add_argument("--objectives", help="comma-separated, overrides the config")
p.add_argument("--seeds", help="comma-separated, overrides the config")
p.add_argument("--domains", help="comma-separated subset of vision, image_text, speech")
p.add_argument("--no-sweep", action="store_true", help="skip the batch-size sweep")
p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
p.add_argument("--no-progress", action="store_true")
a = p.parse_args()

config = load_config(a.config)
if a.output_dir:
    config["output_dir"] = a.output_dir
if a.objectives:
    config["objectives"] = a.objectives.split(",")
if a.seeds:
    config["seeds"] = [int(s) for s in a.seeds.split(",")]
if a.domains:
    unknown = set(a.domains.split(",")) - set(config["domains"])
    if unknown:
        p.error(f"unknown domains {sorted(unknown)}; choose from {sorted(config['domains'])}")
    config["domains"] = {d: config["domains"][d] for d in a.domains.split(",")}
if a.no_sweep:
    config["sweep"] = {}
if a.print_config:
    print(json.dumps(config, indent=2))
    raise SystemExit
report = run_suite(config, progress=not a.no_progress)
print(markdown(report))
print(f"report: {config['output_dir']}/report.md, report.json, report_domains.png")
