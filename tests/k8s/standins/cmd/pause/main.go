// Command pause is the sandbox image's process for the test cluster: it holds a pod's
// namespaces open, reaps whatever is re-parented to it, and exits on SIGINT or SIGTERM.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range sigs {
		if s == syscall.SIGCHLD {
			for {
				var ws syscall.WaitStatus
				pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
				if pid <= 0 || err != nil {
					break
				}
			}
			continue
		}
		os.Exit(0)
	}
}
