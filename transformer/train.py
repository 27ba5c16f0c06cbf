"""`python -m transformer.train` and `torchrun -m transformer.train` (fixed): transformer-train's front door
(cli/train.py). The Trainer is in training/trainer.py."""

from transformer.cli.train import main

if __name__ == "__main__":
    main()
