"""DeepSpeed's getting-started tutorial (https://www.deepspeed.ai/getting-started/), written as a
user would from it: argparse + ``deepspeed.add_config_arguments``, ``deepspeed.init_distributed()``,
``deepspeed.initialize(args=cmd_args, model=net, model_parameters=net.parameters())``, the
``model_engine(batch)`` / ``backward`` / ``step`` loop, and ``save_checkpoint`` /
``load_checkpoint`` with a client state dict. The model and data are tiny and synthetic.

Launched as the tutorial says::

    deepspeed --num_gpus 2 client_entry.py <client args> --deepspeed --deepspeed_config ds_config.json

Three departures from the tutorial's snippet, each needed for it to run (under DeepSpeed 0.19.8
as under ds): ``save_checkpoint``'s keyword is ``client_state`` (the snippet's ``client_sd=`` is a
TypeError in both); the checkpoint id is the loss averaged over the ranks (each rank's own ``loss.item()``
differs, and every rank must save under the same id), and a checkpoint is saved when
``step % save_interval == 0`` (the snippet's ``if step % args.save_interval:`` saves on every
other step instead).
"""

import argparse
import json

import deepspeed
import torch


def add_argument():
    parser = argparse.ArgumentParser(description="getting-started example")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--save_dir", type=str, default=None)
    parser.add_argument("--save_interval", type=int, default=100)
    parser.add_argument("--load_dir", type=str, default=None)
    parser.add_argument("--ckpt_id", type=str, default=None)
    parser.add_argument(
        "--local_loss_id",
        action="store_true",
        help="use this rank's loss.item() as the checkpoint id, as the snippet does",
    )
    parser.add_argument("--out", type=str, required=True, help="where rank 0 writes its report")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(torch.nn.Module):
    """A linear regressor whose forward takes the whole batch and returns the loss, so that
    ``loss = model_engine(batch)`` reads as in the tutorial."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 1)

    def forward(self, batch):
        inputs, targets = batch
        outputs = self.fc(inputs.to(self.fc.weight.dtype))
        return torch.nn.functional.mse_loss(outputs.float(), targets)


def make_data(samples):
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(samples, 16, generator=generator)
    targets = inputs @ torch.full((16, 1), 0.05) + 0.01 * torch.randn(
        samples, 1, generator=generator
    )
    return inputs, targets


def make_data_loader(inputs, targets, batch_size, rank, world_size):
    """This rank's micro-batches, in a fixed order (no shuffling: a resumed run sees the same
    batches as an uninterrupted one)."""
    step_size = batch_size * world_size
    return [
        (
            inputs[i + rank * batch_size : i + (rank + 1) * batch_size],
            targets[i + rank * batch_size : i + (rank + 1) * batch_size],
        )
        for i in range(0, len(inputs) - step_size + 1, step_size)
    ]


def dataloader_to_step(data_loader, step):
    """The batches from ``step`` on."""
    return list(enumerate(data_loader))[step:]


def evaluate(model_engine, inputs, targets):
    with torch.no_grad():
        return model_engine((inputs, targets)).item()


def mean_over_ranks(value):
    tensor = torch.tensor([value], dtype=torch.float64)
    deepspeed.comm.all_reduce(tensor)
    return tensor.item() / deepspeed.comm.get_world_size()


def main():
    cmd_args = add_argument()
    deepspeed.init_distributed()
    torch.manual_seed(1234)
    net = Net()
    model_engine, optimizer, _, _ = deepspeed.initialize(
        args=cmd_args, model=net, model_parameters=net.parameters()
    )
    rank, world_size = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    inputs, targets = make_data(cmd_args.samples)
    data_loader = make_data_loader(
        inputs, targets, model_engine.train_micro_batch_size_per_gpu(), rank, world_size
    )

    # load checkpoint
    loaded = None
    if cmd_args.load_dir is not None:
        _, client_sd = model_engine.load_checkpoint(cmd_args.load_dir, cmd_args.ckpt_id)
        loaded = dict(client_sd)
        step = client_sd["step"]
    else:
        client_sd = {"run": "getting-started"}
        step = -1

    initial_loss = evaluate(model_engine, inputs, targets)
    losses, saved = {}, {}
    # advance data loader to ckpt step
    first_step = step + 1
    for step, batch in dataloader_to_step(data_loader, first_step):
        # forward() method
        loss = model_engine(batch)
        # runs backpropagation
        model_engine.backward(loss)
        # weight update
        model_engine.step()
        losses[step] = mean_over_ranks(loss.item())

        # save checkpoint
        if cmd_args.save_dir is not None and step % cmd_args.save_interval == 0:
            client_sd["step"] = step
            ckpt_id = loss.item() if cmd_args.local_loss_id else f"{losses[step]:.6f}"
            model_engine.save_checkpoint(cmd_args.save_dir, ckpt_id, client_state=client_sd)
            saved[ckpt_id] = dict(client_sd)

    report = {
        "world_size": world_size,
        "fp16": model_engine.fp16_enabled(),
        "zero_stage": model_engine.zero_optimization_stage(),
        "optimizer": type(optimizer).__name__,
        "loaded": loaded,
        "saved": saved,
        "losses": losses,
        "initial_loss": initial_loss,
        "final_loss": evaluate(model_engine, inputs, targets),
        "global_steps": model_engine.global_steps,
        "skipped_steps": model_engine.skipped_steps,
    }
    if rank == 0:
        with open(cmd_args.out, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
