"""Test-wide settings."""

import torch

# The test models are tiny: one intra-op thread is fastest and keeps timings sane when the two CI
# cores are shared with other work.
torch.set_num_threads(1)
