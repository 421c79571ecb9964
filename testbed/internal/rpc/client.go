package rpc

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"

	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
)

// Client calls other services' JSON operations. Each call is a client span made by otelhttp,
// named after the operation ("compose_text_client") and carrying peer.service.
type Client struct {
	base    *http.Transport
	timeout time.Duration

	mu    sync.RWMutex
	peers map[string]peer
}

type peer struct {
	url  string
	http *http.Client
}

// NewClient returns a client for the peers (service name -> base URL) with a per-call timeout.
func NewClient(peers map[string]string, timeout time.Duration) *Client {
	c := &Client{
		base: &http.Transport{
			MaxIdleConns:        1024,
			MaxIdleConnsPerHost: 256, // keep-alive connections for every concurrent call
			IdleConnTimeout:     90 * time.Second,
		},
		timeout: timeout,
	}
	c.SetPeers(peers)
	return c
}

// SetPeers replaces the peers (a reload may point a peer at a delay proxy).
func (c *Client) SetPeers(peers map[string]string) {
	m := make(map[string]peer, len(peers))
	for name, url := range peers {
		tr := otelhttp.NewTransport(c.base,
			otelhttp.WithSpanNameFormatter(func(_ string, r *http.Request) string {
				return clientSpanName(r.URL.Path)
			}),
			otelhttp.WithSpanOptions(trace.WithAttributes(attribute.String("peer.service", name))))
		m[name] = peer{url: strings.TrimSuffix(url, "/"), http: &http.Client{Transport: tr, Timeout: c.timeout}}
	}
	c.mu.Lock()
	c.peers = m
	c.mu.Unlock()
}

func clientSpanName(path string) string {
	return strings.ReplaceAll(strings.TrimPrefix(path, "/"), "/", "_") + "_client"
}

// Call runs the operation name on the service peerName: POST /name with req as JSON, the JSON
// answer decoded into resp (which may be nil).
func (c *Client) Call(ctx context.Context, peerName, name string, req, resp any) error {
	c.mu.RLock()
	p, ok := c.peers[peerName]
	c.mu.RUnlock()
	if !ok {
		return fmt.Errorf("no peer %q in the configuration", peerName)
	}
	body, err := json.Marshal(req)
	if err != nil {
		return fmt.Errorf("%s.%s: encode request: %w", peerName, name, err)
	}
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, p.url+"/"+name, bytes.NewReader(body))
	if err != nil {
		return fmt.Errorf("%s.%s: %w", peerName, name, err)
	}
	hreq.Header.Set("Content-Type", "application/json")
	hresp, err := p.http.Do(hreq)
	if err != nil {
		return fmt.Errorf("%s.%s: %w", peerName, name, err)
	}
	defer hresp.Body.Close()
	data, err := io.ReadAll(hresp.Body)
	if err != nil {
		return fmt.Errorf("%s.%s: read answer: %w", peerName, name, err)
	}
	if hresp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s.%s: HTTP %d: %s", peerName, name, hresp.StatusCode, bytes.TrimSpace(data))
	}
	if resp == nil {
		return nil
	}
	if err := json.Unmarshal(data, resp); err != nil {
		return fmt.Errorf("%s.%s: decode answer: %w", peerName, name, err)
	}
	return nil
}
