"""The paper's maths and the statistics beside it, pure functions on tensors and arrays: the losses
(Eq. 1-10), group advantages, log-probs, avg@K / pass@K, the step's typed statistics, the update's
row plan, and the statistics of `compare` and the health verdict (the bottom layer)."""
