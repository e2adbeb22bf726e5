"""The Triton path of the negatives' statistics, in one place: its entry and autograd op (stats.py:
negative_stats_triton, and route, the sub-path a call's plan takes: the forward's logits, TF32, float16 unit
vectors), and its kernels, one per file, each tested against the blockwise torch kernel (chunked.py) in
tests/losses/test_triton_stats.py and test_triton_kernels.py:

- stats_fwd.py: the forward statistics (rows' lse and mean, the columns' partials per row tile: image-text's,
  and two views' over the upper triangle);
- dlogits.py: backward's d loss / d logits for a block of rows and columns, from cuBLAS's float32 logits,
  written once in the inputs' dtype (two views: dL + dL^T, for one product);
- common.py: the device helpers they share; launch.py: tiles, autotune spaces, launches.

cuBLAS does the products of a band of d logits with the features (stats.py).
"""
