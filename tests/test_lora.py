"""nanoagent/lora.py: only the adapters train, and the sampler is given peft's own merge (train.py --lora_rank's
checkpoints and resume: test_train.py; 2 ranks: test_parallel.py; the push to vLLM: test_vllm_sampler.py)."""

import copy

import torch
from peft.tuners.lora import LoraLayer

from nanoagent.lora import add_lora, base_name
from nanoagent.models import load_model
from nanoagent.sampler import TorchSampler


def test_the_sampler_gets_peft_s_own_merge_and_the_trainer_keeps_its_base_weights():
    policy = add_lora(load_model("tiny")[0], rank=4)
    assert {name for name, p in policy.named_parameters() if p.requires_grad} == {
        name for name in policy.state_dict() if ".lora_" in name}
    base = {name: tensor.clone() for name, tensor in policy.state_dict().items() if ".base_layer." in name}
    with torch.no_grad():  # B starts at zero (the merge would be the base): give it what training would
        generator = torch.Generator().manual_seed(0)
        for name, parameter in policy.named_parameters():
            if ".lora_B." in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    reference = copy.deepcopy(policy)
    for module in reference.modules():
        if isinstance(module, LoraLayer):
            module.merge()  # peft's merge, in place: W += s·B·A
    expected = {base_name(name): tensor for name, tensor in reference.state_dict().items() if ".lora_" not in name}
    copy_model = load_model("tiny")[0]  # how a sharded run samples: an unsharded copy given full_weights
    TorchSampler(copy_model).update_weights(policy, torch.float32)
    pushed = copy_model.state_dict()
    assert pushed.keys() == expected.keys()
    assert all(torch.equal(pushed[name], expected[name]) for name in expected)
    assert any(not torch.equal(pushed[base_name(name)], tensor) for name, tensor in base.items())
    assert all(torch.equal(policy.state_dict()[name], tensor) for name, tensor in base.items())  # no merge left in
    tokens = torch.tensor([list(range(10, 60))])
    with torch.no_grad():  # and the merged copy computes what the adapters do
        assert torch.allclose(copy_model(tokens).logits, policy(tokens).logits, atol=1e-5, rtol=0)
