"""``mnn-rollout demo``: the operator's own ``Reconciler`` drives a local runtime process through
local implementations of its ports (children, status, pods); a terminal view follows it."""
