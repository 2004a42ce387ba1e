"""A real Hugging Face transformers model (built from a small config, no download) trained through
octopipe.compile on 2 gloo processes equals single-process training: loss and every gradient,
under a 1F1B, a zero-bubble and a V-shaped schedule, tied embeddings included (GPT-2)."""

import warnings

import pytest
import torch

import octopipe
from octopipe.runtime import launch

transformers = pytest.importorskip("transformers")
CLUSTER = octopipe.ClusterSpec.preset("cpux2")
SCHEDULES = ("1f1b", "zb-h1", "zb-v")


def _model(kind: str):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "llama":
            config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                              num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=64, use_cache=False)
            return transformers.LlamaForCausalLM(config).eval()
        config = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=4, n_head=4, n_positions=64, use_cache=False,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(config).eval()


def _loss(logits, target):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _worker(rank, world_size, pipes, ids, target):
    results = []
    for pipe in pipes:
        engine = pipe.engine(rank)
        loss = engine.step((ids,), target)
        results.append((loss, {name: p.grad.clone() for name, p in engine.named_parameters()}))
        engine.zero_grad()
    return results


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_huggingface_model_trains_exactly_on_two_ranks(kind):
    model = _model(kind)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (4, 16), generator=generator)
    target = torch.randint(0, 96, (4, 16), generator=generator)
    pipes = [octopipe.compile(model, CLUSTER, example_inputs=(ids,), example_target=target, loss_fn=_loss,
                              num_microbatches=2, schedule=name) for name in SCHEDULES]
    assert pipes[0].graph.method == "export"  # transformers models need torch.export, not fx
    # a pipeline travels pickled where launch spawns (a CUDA build of torch): the exported module,
    # which does not pickle, stays here
    import pickle

    back = pickle.loads(pickle.dumps(pipes[0]))
    assert back.graph == pipes[0].graph and back.graph.module is None and back.plan == pipes[0].plan
    # the stages share the model's parameter objects (and so .grad): run the reference after the
    # workers have forked, as engines accumulate into .grad like backward() does
    per_rank = launch(_worker, 2, args=(pipes, ids, target))
    reference = _loss(model(ids).logits, target)
    reference.backward()
    expected = {name: p.grad for name, p in model.named_parameters()}
    for index, schedule in enumerate(SCHEDULES):
        grads = {}
        for rank_results in per_rank:
            loss, rank_grads = rank_results[index]
            assert loss == pytest.approx(reference.item(), abs=1e-6), schedule
            grads.update(rank_grads)
        assert set(grads) == set(expected), schedule
        for name, grad in expected.items():
            torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-5, msg=f"{schedule}: {name}")
