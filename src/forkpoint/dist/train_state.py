"""Model and optimizer state through torch.distributed.checkpoint.state_dict (FSDP2, DDP, TP)."""


class TrainState:
    """A stateful pair (model, optimizer) whose state_dict uses torch's distributed state-dict
    API: DTensor shards for FSDP2/tensor parallelism, FQN keys without wrapper prefixes, and
    an optimizer state initialised before a restore, so that a fresh optimizer can be loaded
    on any number of ranks."""

    def __init__(self, model, optimizer=None):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, sd: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if self.optimizer is None:
            set_model_state_dict(self.model, sd["model"])
        else:
            set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"],
                           optim_state_dict=sd["optim"])
