package telemetry

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"

	"go.opentelemetry.io/otel"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
)

// receiver keeps what real OTLP exporters send it.
type receiver struct {
	coltracepb.UnimplementedTraceServiceServer
	mu   sync.Mutex
	reqs []*coltracepb.ExportTraceServiceRequest
}

func (r *receiver) Export(_ context.Context, req *coltracepb.ExportTraceServiceRequest) (*coltracepb.ExportTraceServiceResponse, error) {
	r.mu.Lock()
	r.reqs = append(r.reqs, req)
	r.mu.Unlock()
	return &coltracepb.ExportTraceServiceResponse{}, nil
}

// check ends one span through Setup's provider and finds it, with its resource, in the receiver.
func check(t *testing.T, endpoint string, r *receiver) {
	t.Helper()
	shutdown, err := Setup(context.Background(), "text-service", "text-service@127.0.0.1:1", endpoint)
	if err != nil {
		t.Fatal(err)
	}
	_, span := otel.Tracer("test").Start(context.Background(), "compose_text_server")
	span.End()
	if err := shutdown(context.Background()); err != nil { // flushes the batch
		t.Fatal(err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.reqs) == 0 {
		t.Fatal("nothing exported")
	}
	rs := r.reqs[0].ResourceSpans[0]
	attrs := map[string]string{}
	for _, kv := range rs.Resource.Attributes {
		attrs[kv.Key] = kv.Value.GetStringValue()
	}
	if attrs["service.name"] != "text-service" || attrs["service.instance.id"] != "text-service@127.0.0.1:1" {
		t.Fatalf("resource %v", attrs)
	}
	if name := rs.ScopeSpans[0].Spans[0].Name; name != "compose_text_server" {
		t.Fatalf("span %q", name)
	}
}

func TestExportOverGRPC(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	r := &receiver{}
	coltracepb.RegisterTraceServiceServer(srv, r)
	go func() { _ = srv.Serve(ln) }()
	defer srv.Stop()
	check(t, ln.Addr().String(), r)
}

func TestExportOverHTTP(t *testing.T) {
	r := &receiver{}
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		body, _ := io.ReadAll(req.Body)
		var m coltracepb.ExportTraceServiceRequest
		if req.URL.Path != "/v1/traces" || proto.Unmarshal(body, &m) != nil {
			http.Error(w, "bad export", http.StatusBadRequest)
			return
		}
		_, _ = r.Export(req.Context(), &m)
		w.Header().Set("Content-Type", "application/x-protobuf")
	}))
	defer ts.Close()
	check(t, ts.URL, r)
}
