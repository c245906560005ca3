"""Job entrypoint: fine-tune from a Hugging Face-format Llama directory (`ckpt consolidate`
output or a `save_pretrained` Llama).

    ray job submit --working-dir . -- python jobs/finetune.py HF_DIR CONFIG [k=v ...]

Thin on purpose: the directory's config.json gives the model shape (`model.*` settings, which
later overrides may not contradict), `model.init_from` makes the fresh run start from its
weights, and the coordinator does the rest. A resubmitted job with the same run.dir resumes
from its own checkpoints instead.
"""

import sys
from pathlib import Path

# With --working-dir the package arrives as source next to this file, not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raytrain_dt.checkpoint.initial import model_overrides
from raytrain_dt.cli import main as cli_main
from raytrain_dt.errors import UserError


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: finetune.py HF_DIR CONFIG [key=value ...]", file=sys.stderr)
        return 2
    directory, recipe, *overrides = argv
    try:
        shape = model_overrides(str(Path(directory).resolve()))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return cli_main(["train", recipe, *shape, *overrides])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
