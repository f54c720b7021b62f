"""torch.compile per block: compiled blocks inside fully_shard train like the unsharded model.

aot_eager keeps the test cheap on CPU (it runs dynamo and AOTAutograd, not inductor's codegen).
Tolerance as in test_parity's fp32 cases.
"""

import copy


from fsdp2.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=67, seq_len=16, dim=36, n_layers=2, n_heads=3)


def _train_compiled(rank, world_size):
    import torch._dynamo
    import torch.distributed as dist

    from fsdp2 import fully_shard

    torch._dynamo.reset()
    reference = GPT(CFG)
    model = copy.deepcopy(reference)
    for block in model.blocks:
        fully_shard(block)
        block.compile(backend="aot_eager")
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        tokens = torch.randint(
            0, CFG.vocab_size, (2 * world_size, CFG.seq_len + 1), generator=torch.Generator().manual_seed(step)
        )
        x, y = tokens[:, :-1], tokens[:, 1:]
        rows = slice(2 * rank, 2 * rank + 2)
        loss = model.loss(x[rows], y[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = reference.loss(x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append((global_loss.item() / world_size, ref_loss.item()))
    worst = max((p.full_tensor() - r).abs().max().item() for p, r in zip(model.parameters(), reference.parameters()))
    return losses, worst


def test_compiled_blocks_match_reference(worlds):
    losses, worst = worlds.run(2, _train_compiled)[0]
    for loss, ref_loss in losses:
        assert abs(loss - ref_loss) <= 2e-5 + 1e-4 * abs(ref_loss)
    assert worst <= 1.2e-4
