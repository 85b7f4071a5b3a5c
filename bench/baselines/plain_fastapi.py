"""The baseline of the target "mnn-rollout JSON >= 2x a plain FastAPI app" (bench/throughput.py): a
plain FastAPI + pydantic OIP endpoint around the same MNN model, one model copy per uvicorn
worker. Run: MODEL=path uvicorn baselines.plain_fastapi:app"""

from __future__ import annotations

import os
from typing import Any

import MNN.expr as F
import MNN.nn as nn
import numpy as np
from fastapi import FastAPI
from pydantic import BaseModel

rt = nn.create_runtime_manager(({"backend": "CPU", "numThread": 1},))
module = nn.load_module_from_file(os.environ["MODEL"], [], [], runtime_manager=rt)
app = FastAPI()


class Tensor(BaseModel):
    name: str
    datatype: str
    shape: list[int]
    data: list[Any]


class InferRequest(BaseModel):
    inputs: list[Tensor]


@app.post("/v2/models/{name}/infer")
def infer(name: str, req: InferRequest) -> dict[str, Any]:
    t = req.inputs[0]
    x = np.asarray(t.data, dtype=np.float32).reshape(t.shape)
    out = module.forward([F.const(x, list(x.shape), F.NCHW)])[0].read().copy()
    return {"model_name": name, "outputs": [{"name": "scores", "datatype": "FP32", "shape": list(out.shape),
                                             "data": out.ravel().tolist()}]}
