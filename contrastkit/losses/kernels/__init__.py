"""Triton kernels of the negatives' statistics, one kernel per file beside the torch reference they are
tested against (contrastkit/losses/triton_stats.py joins them into the autograd op, with cuBLAS for the
products of a band of d logits with the features):

- stats_fwd.py: the forward statistics (rows' lse and mean, the columns' partials per row tile: image-text's,
  and two views' over the upper triangle);
- dlogits.py: backward's d loss / d logits for a block of rows and columns, from cuBLAS's float32 logits,
  written once in the inputs' dtype (two views: dL + dL^T, for one product);
- common.py: the device helpers they share; launch.py: tiles, autotune spaces, launches.
"""
