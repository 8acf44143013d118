// Command registrar announces a CSI driver's node socket to the kubelet, taking the flags
// of the node-driver-registrar sidecar that the manifests name (--csi-address,
// --kubelet-registration-path). The test cluster runs it in that sidecar's place because the
// Go module proxy does not serve github.com/kubernetes-csi/node-driver-registrar.
//
// It asks the driver for its name (Identity.GetPluginInfo), listens on
// /registration/<name>-reg.sock and answers the kubelet's plugin watcher
// (pluginregistration.Registration): GetInfo names the driver, its socket as the kubelet
// sees it and the CSI versions; NotifyRegistrationStatus says whether the kubelet took it,
// and a refusal ends the process so that the container restarts and the refusal is seen.
package main

import (
	"context"
	"flag"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	csi "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	reg "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

type server struct {
	reg.UnimplementedRegistrationServer
	name     string
	endpoint string
}

func (s *server) GetInfo(context.Context, *reg.InfoRequest) (*reg.PluginInfo, error) {
	return &reg.PluginInfo{
		Type:              "CSIPlugin",
		Name:              s.name,
		Endpoint:          s.endpoint,
		SupportedVersions: []string{"1.0.0"},
	}, nil
}

func (s *server) NotifyRegistrationStatus(_ context.Context, st *reg.RegistrationStatus) (*reg.RegistrationStatusResponse, error) {
	if !st.PluginRegistered {
		log.Printf("the kubelet refused %s: %s", s.name, st.Error)
		os.Exit(1)
	}
	log.Printf("the kubelet registered %s at %s", s.name, s.endpoint)
	return &reg.RegistrationStatusResponse{}, nil
}

// driverName asks the driver behind addr for its name, retrying while it starts.
func driverName(addr string) string {
	conn, err := grpc.NewClient("unix://"+addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		log.Fatalf("connecting to %s: %v", addr, err)
	}
	defer conn.Close()
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		info, err := csi.NewIdentityClient(conn).GetPluginInfo(ctx, &csi.GetPluginInfoRequest{})
		cancel()
		if err == nil && info.GetName() != "" {
			return info.GetName()
		}
		log.Printf("waiting for the driver at %s: %v", addr, err)
		time.Sleep(time.Second)
	}
}

func main() {
	csiAddr := flag.String("csi-address", "/csi/csi.sock", "the driver's socket in this container")
	kubeletPath := flag.String("kubelet-registration-path", "", "the driver's socket as the kubelet sees it")
	regDir := flag.String("plugin-registration-path", "/registration", "the kubelet's plugin registry")
	flag.Int("v", 0, "accepted for the sidecar's flags; unused")
	flag.Parse()
	if *kubeletPath == "" {
		log.Fatal("--kubelet-registration-path is required")
	}
	name := driverName(*csiAddr)
	sock := filepath.Join(*regDir, name+"-reg.sock")
	if err := os.Remove(sock); err != nil && !os.IsNotExist(err) {
		log.Fatalf("removing the old %s: %v", sock, err)
	}
	lis, err := net.Listen("unix", sock)
	if err != nil {
		log.Fatalf("listening on %s: %v", sock, err)
	}
	g := grpc.NewServer()
	reg.RegisterRegistrationServer(g, &server{name: name, endpoint: *kubeletPath})
	go func() {
		sigs := make(chan os.Signal, 1)
		signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
		<-sigs
		g.Stop()
		// Gone, so the kubelet's watcher unregisters the driver.
		if err := os.Remove(sock); err != nil && !os.IsNotExist(err) {
			log.Printf("removing %s: %v", sock, err)
		}
		os.Exit(0)
	}()
	log.Printf("serving the registration of %s on %s", name, sock)
	if err := g.Serve(lis); err != nil {
		log.Fatalf("serving: %v", err)
	}
}
