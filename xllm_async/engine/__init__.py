"""What to run and when: requests, sampling, batches and the two schedulers."""
