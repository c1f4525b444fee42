"""Pure tensor math of GRPO and its variants: advantages, KL estimators, policy losses, log-probs.

Imports only torch. Every function states its formula and the paper it comes from, and is tested
against an independent float64 reference in ``tests/algo``.
"""

from grpokit.algo.advantages import decoupled_advantages, group_advantages, zero_std_groups
from grpokit.algo.kl import kl_penalty, kl_shaped_rewards
from grpokit.algo.logprobs import hidden_token_entropy, hidden_token_logprobs, token_entropy, token_logprobs
from grpokit.algo.losses import LossSpec, policy_loss

__all__ = [
    "LossSpec",
    "decoupled_advantages",
    "group_advantages",
    "hidden_token_entropy",
    "hidden_token_logprobs",
    "kl_penalty",
    "kl_shaped_rewards",
    "policy_loss",
    "token_entropy",
    "token_logprobs",
    "zero_std_groups",
]
