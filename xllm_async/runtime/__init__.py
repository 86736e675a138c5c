"""Where work runs: device and stream binding, the model runner, execution slots."""
