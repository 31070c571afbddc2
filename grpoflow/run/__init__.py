"""The run dir `runs/<run_id>/`: its paths (`paths`), provenance (`info`), checkpoints and the step commit
(`checkpoint`, `commit`), metrics (`metrics`), and picking a run up again (`resume`) or repeating it (`rerun`)."""
