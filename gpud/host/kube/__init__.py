"""Kubernetes: the node's labels and pods, DRA ResourceSlices and claims, the kubelet plugin, NFD's feature file."""
