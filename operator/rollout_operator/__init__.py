"""rollout_operator: the kopf operator that walks ModelDeployment canaries forward or back."""
