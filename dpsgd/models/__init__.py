"""Models: the networks of the paper and the frontier recipes, and public pretrained weights."""
