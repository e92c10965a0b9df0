"""Training checkpoints (torch.distributed.checkpoint): save on one mesh, resume on any (see docs/checkpoints.md).

    save_checkpoint(save_dir, iteration, engine, meta={...})   # collective; SAVE_DIR/iter_NNNNNNN + latest
    save_checkpoint(..., background=True); ...; wait_for_save()  # hashed and published while training goes on
    meta = load_checkpoint(save_dir, engine)                     # collective; any tp/pp/dp/ZeRO
    model = load_model(save_dir_or_model_folder, mesh)           # weights only, for inference or fine-tuning
"""

from tpzoo.checkpoint.load import load_checkpoint
from tpzoo.checkpoint.model import load_model
from tpzoo.checkpoint.paths import latest_iteration, read_meta, resolve_checkpoint
from tpzoo.checkpoint.save import save_checkpoint, wait_for_save

__all__ = ["latest_iteration", "load_checkpoint", "load_model", "read_meta", "resolve_checkpoint", "save_checkpoint",
           "wait_for_save"]
