// Command etcd is etcd's own server entry point, built at the version that
// Kubernetes pins (go.etcd.io/etcd/server/v3 in go.mod).
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
