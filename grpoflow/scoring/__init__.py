"""Stage 3, evaluate: each trial's verifier reward and exit status as a sample (`outcome`), the groups that train
(`groups`), a step's metrics (`metrics`), one step's trials run and scored (`step`), and the policy's evaluation
before and after training (`evaluation`)."""
