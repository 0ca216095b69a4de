"""The native kernels run without the GIL (a server's event loop streams while a forward
runs), so Python threads may call them at once: they take turns on the one worker pool."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels import native
from tokenmill.kernels.linear import pack_linear_weight, packed_linear

needs_native = pytest.mark.skipif(
    native.native_kernels() is None, reason="native kernels not buildable here"
)


@needs_native
def test_threads_calling_at_once_get_what_each_would_alone() -> None:
    torch.manual_seed(1)
    weights = [torch.randn(n, 256) for n in (384, 200)]
    packed = [pack_linear_weight(w) for w in weights]
    inputs = [torch.randn(rows, 256) for rows in (1, 5, 33, 70)]
    results: dict[tuple[int, int], list[torch.Tensor]] = {}
    errors: list[BaseException] = []

    def work(which: int) -> None:
        try:
            for _ in range(10):
                for i, x in enumerate(inputs):
                    out = packed_linear(x, packed[which], weights[which].shape[0], None)
                    results.setdefault((which, i), []).append(out)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(which,)) for which in (0, 1, 0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors and not any(thread.is_alive() for thread in threads)
    for (which, i), outs in results.items():
        expected = F.linear(inputs[i], weights[which])
        assert len(outs) == 20
        for out in outs:
            torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
