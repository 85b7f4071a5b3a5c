"""A minimal MLServer custom runtime serving one ``.mnn`` file (``parameters.uri`` in
model-settings.json), for the peer benchmarks. It runs in MLServer's own virtualenv
(bench/peers.py creates it), not the project's: MLServer 1.7.1 + MNN 3.6.1 + numpy.

MNN driven as the runtime drives it (runtime/mnn_runtime/model.py): a runtime manager with
numThread=1, since MNN 3.6.1 ignores the ``thread_num`` argument and without a runtime manager
starts a 4-thread pool; inputs as a list of Vars; outputs copied out of MNN's buffer. One module
per MLServer worker process; requests of one process run one at a time on its event loop, so the
module is never used from two threads at once.
"""

from __future__ import annotations

import MNN.expr as F
import MNN.nn as nn
import numpy as np
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class MNNModel(MLModel):
    async def load(self) -> bool:
        uri = self.settings.parameters.uri if self.settings.parameters else None
        if not uri:
            raise ValueError("model-settings.json: parameters.uri must name the .mnn file")
        self._rt = nn.create_runtime_manager(({"backend": "CPU", "numThread": 1},))
        self._module = nn.load_module_from_file(uri, [], [], runtime_manager=self._rt)
        info = self._module.get_info()
        self._inputs = list(info["inputNames"])
        self._outputs = list(info["outputNames"])
        self._shapes = [list(v.shape) for v in info["inputs"]]
        self._formats = [v.data_format for v in info["inputs"]]
        # pack the weights now, not on the first request
        self._forward([np.zeros([1 if d < 0 else d for d in s], dtype=np.float32) for s in self._shapes])
        return True

    def _forward(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        for x, want in zip(arrays, self._shapes):
            # batch (dimension 0) free; MNN returns [] if it cannot take it (checked below)
            if x.ndim != len(want) or any(w >= 0 and w != d for w, d in zip(want[1:], x.shape[1:])):
                raise ValueError(f"input shape {list(x.shape)} does not fit {want}")
        xs = [F.const(np.ascontiguousarray(x, dtype=np.float32), list(x.shape), fmt)
              for x, fmt in zip(arrays, self._formats)]
        outs = self._module.forward(xs)
        if len(outs) != len(self._outputs):
            raise ValueError("MNN returned no output (bad input shape?)")
        return [o.read().copy() for o in outs]

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        if len(payload.inputs) != len(self._inputs):
            raise ValueError(f"expected {len(self._inputs)} input(s), got {len(payload.inputs)}")
        by_name = {i.name: i for i in payload.inputs}
        ordered = [by_name.get(n, payload.inputs[k]) for k, n in enumerate(self._inputs)]
        outs = self._forward([NumpyCodec.decode_input(i) for i in ordered])
        return InferenceResponse(
            model_name=self.name,
            model_version=self.version,
            outputs=[NumpyCodec.encode_output(name, out) for name, out in zip(self._outputs, outs)],
        )
