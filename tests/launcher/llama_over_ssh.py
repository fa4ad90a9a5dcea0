"""Run by dtorch-launch in test_llama_over_ssh: dtorch's Llama loaded from a save_pretrained directory
(argv[1]) onto a tensor-parallel mesh over the hostfile's hosts, each worker reading its own slices
of the safetensors file. Prints ``LOGITS <json>`` for the ids in argv[2] (json) and ``TOKENS <json>``
for greedy generation from them, then ``BYTES <n>``: weight bytes that passed through this process."""
import json
import sys

import torch

import dtorch
from dtorch.models import LlamaForCausalLM


def main() -> None:
    directory, ids = sys.argv[1], torch.tensor(json.loads(sys.argv[2]))
    mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["tp"])
    model = LlamaForCausalLM.from_pretrained(directory, device_mesh=mesh)
    print("LOGITS " + json.dumps(model(ids).logits.to_torch().tolist()), flush=True)
    print("TOKENS " + json.dumps(model.generate(ids, max_new_tokens=5, eos_token_id=None).tolist()), flush=True)
    print(f"BYTES {dtorch.stats()['checkpoint_bytes_via_controller']}", flush=True)
    dtorch.shutdown()


if __name__ == "__main__":
    main()
