"""The bundled demo: a 2.9M-parameter DiffusionGemma checkpoint (the files beside this one, trained by
``checkpoint_tools/train_demo.py``), its tasks (``tasks.py``) and their evaluation (``python -m
mlx_dgemma.demo.eval``)."""

from pathlib import Path

DEMO_MODEL = Path(__file__).resolve().parent  # the checkpoint's folder
