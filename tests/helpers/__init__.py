"""What the tests share: fast CLI arguments, tiny IDX data, short real-Trainer runs, callbacks that kill."""
