"""The PyTorch DDP tutorial's multigpu_torchrun.py (CPU, gloo), as its authors wrote it, and
migrated to accel_ctx with the smallest change (``--accel``: the set-up and the DDP wrapper
replaced by ``with distributed():``). Each rank prints what it trained on and what it saved.

    torchrun --standalone --nproc-per-node 2 ddp_tutorial.py SNAPSHOT
    accel-ctx launch -n 2 ddp_tutorial.py SNAPSHOT --accel
"""

import hashlib
import os
import sys

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

ACCEL = "--accel" in sys.argv


class MyTrainDataset(Dataset):
    def __init__(self, size):
        self.size = size
        g = torch.Generator().manual_seed(0)
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index]


def ddp_setup():
    init_process_group(backend="gloo")


def digest(values):
    return hashlib.sha256(repr(values).encode()).hexdigest()[:12]


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path):
        self.gpu_id = int(os.environ["LOCAL_RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if not ACCEL:
            self.model = DDP(self.model)

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[GPU{self.gpu_id}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}")
        self.train_data.sampler.set_epoch(epoch)
        seen = []
        for source, targets in self.train_data:
            seen.append(source[:, 0].tolist())
            self._run_batch(source, targets)
        print(f"rank {self.gpu_id} epoch {epoch} batches {digest(seen)}")

    def _save_snapshot(self, epoch):
        model = self.model.module if not ACCEL else self.model
        snapshot = {"MODEL_STATE": model.state_dict(), "EPOCHS_RUN": epoch}
        if self.gpu_id == 0:
            torch.save(snapshot, self.snapshot_path)
            torch.save(model, self.snapshot_path + ".model")  # the whole model, pickled

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if epoch % self.save_every == 0:
                self._save_snapshot(epoch)
        model = self.model.module if not ACCEL else self.model
        weights = [round(v.sum().item(), 6) for v in model.state_dict().values()]
        print(f"rank {self.gpu_id} weights {digest(weights)}")


def load_train_objs():
    train_set = MyTrainDataset(64)
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    return train_set, model, optimizer


def prepare_dataloader(dataset, batch_size):
    return DataLoader(dataset, batch_size=batch_size, pin_memory=False, shuffle=False,
                      sampler=DistributedSampler(dataset))


def main(save_every, total_epochs, batch_size, snapshot_path):
    if not ACCEL:
        ddp_setup()
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path)
    trainer.train(total_epochs)
    if not ACCEL:
        destroy_process_group()


if __name__ == "__main__":
    snapshot = sys.argv[1]
    if ACCEL:
        from accel_ctx import distributed

        with distributed():
            main(1, 3, 4, snapshot)
    else:
        main(1, 3, 4, snapshot)
    if int(os.environ["RANK"]) == 0:  # what was saved loads as plain torch loads it
        state = torch.load(snapshot, weights_only=True)
        with torch.serialization.safe_globals([torch.nn.Linear]):
            whole = torch.load(snapshot + ".model", weights_only=True)
        print(f"loaded epochs_run {state['EPOCHS_RUN']} "
              f"{digest([round(v.sum().item(), 6) for v in whole.state_dict().values()])}")
