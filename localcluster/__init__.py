"""A real local Kubernetes control plane (etcd, kube-apiserver, controllers, scheduler) for tests and the demo."""
