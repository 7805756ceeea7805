"""torchao is imported by what uses it, not by every process that imports transformers' models
(offload_core/loading/torchao_later.py); transformers' torchao quantizer still sees torchao and saves as before."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests import ROOT

pytest.importorskip("torchao", reason="the quant extra is not installed")

IMPORTS = """
import sys
import offload_core
import transformers.modeling_utils
from transformers import LlamaConfig, LlamaForCausalLM
LlamaForCausalLM(LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=32))
print(sorted(name for name in sys.modules if name.split(".")[0] == "torchao"))
"""


@pytest.mark.slow
def test_a_process_that_builds_a_model_imports_no_torchao():
    done = subprocess.run([sys.executable, "-c", IMPORTS], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_the_torchao_quantizer_sees_torchao_and_flattens_as_torchao_does():
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict
    from torchao.quantization import Int8WeightOnlyConfig, quantize_
    from transformers.quantizers import quantizer_torchao
    from transformers.utils import import_utils

    assert quantizer_torchao.is_torchao_available is import_utils.is_torchao_available
    assert quantizer_torchao.is_torchao_available()
    model = torch.nn.Sequential(torch.nn.Linear(32, 16, dtype=torch.bfloat16))
    quantize_(model, Int8WeightOnlyConfig())
    ours, theirs = (
        f(model.state_dict()) for f in (quantizer_torchao.flatten_tensor_state_dict, flatten_tensor_state_dict)
    )
    assert ours[1] == theirs[1]  # the metadata
    assert ours[0].keys() == theirs[0].keys()
    assert all(torch.equal(ours[0][k], theirs[0][k]) for k in ours[0])
