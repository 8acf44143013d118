// The test cluster's DNS server: CoreDNS with the few plugins a cluster's DNS needs (the
// Service and pod names of the kubernetes plugin, an answer cache, error logging, and the
// address it binds), built from the coredns module as one would with its plugin.cfg trimmed.
// Pods resolve Service names through it (the kubelet's clusterDNS), as in any cluster; the
// resizer's ublkd-csi finds every node's ublkd through the remote-access Service's name.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/kubernetes"
)

// The order in which a query passes the plugins a Corefile may name (CoreDNS's own order).
func init() {
	dnsserver.Directives = []string{"bind", "errors", "cache", "kubernetes"}
}

func main() { coremain.Run() }
