"""``DataParallel(model, exact=True, slices=V)``: the same bits at any world size.

Owns the slices of a step (``slices``: which samples each holds, its random stream,
the pinned thread count), the reproducible fixed-point mean (``exact_sum``) and the
reducer that runs a rank's slices and sums their gradients (``exact_reducer``).
"""
