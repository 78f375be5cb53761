"""Evaluation: LLaDA's Monte-Carlo log-likelihood (loglik.py) and the lm-evaluation-harness model
(lm_eval_model.py, needs the `eval` extra); task YAMLs in tasks/."""
