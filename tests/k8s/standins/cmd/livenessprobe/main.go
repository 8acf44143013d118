// Command livenessprobe turns a CSI driver's Identity.Probe into an HTTP /healthz for the
// kubelet's liveness probe, taking the flags of the livenessprobe sidecar that the manifests
// name (--csi-address, --http-endpoint). The test cluster runs it in that sidecar's place
// because the Go module proxy does not serve github.com/kubernetes-csi/livenessprobe.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net/http"
	"time"

	csi "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

func main() {
	csiAddr := flag.String("csi-address", "/csi/csi.sock", "the driver's socket")
	endpoint := flag.String("http-endpoint", ":9808", "where /healthz is served")
	timeout := flag.Duration("probe-timeout", 10*time.Second, "how long one Probe may take")
	flag.Int("v", 0, "accepted for the sidecar's flags; unused")
	flag.Parse()
	conn, err := grpc.NewClient("unix://"+*csiAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		log.Fatalf("connecting to %s: %v", *csiAddr, err)
	}
	http.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), *timeout)
		defer cancel()
		resp, err := csi.NewIdentityClient(conn).Probe(ctx, &csi.ProbeRequest{})
		switch {
		case err != nil:
			http.Error(w, fmt.Sprintf("probe failed: %v", err), http.StatusInternalServerError)
		case resp.GetReady() != nil && !resp.GetReady().GetValue():
			http.Error(w, "driver not ready", http.StatusInternalServerError)
		default:
			fmt.Fprintln(w, "ok")
		}
	})
	log.Printf("serving /healthz on %s for %s", *endpoint, *csiAddr)
	log.Fatal(http.ListenAndServe(*endpoint, nil))
}
