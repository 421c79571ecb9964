package proxy

import (
	"bufio"
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// echo serves lines back on a real TCP listener.
func echo(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_, _ = io.Copy(c, c)
			}()
		}
	}()
	return ln.Addr().String()
}

func startProxy(t *testing.T, upstream string) (*Proxy, string) {
	t.Helper()
	p := New(upstream, slog.New(slog.NewTextHandler(io.Discard, nil)))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() { _ = p.Serve(ln) }()
	return p, ln.Addr().String()
}

// roundTrips returns the fastest of n line round trips through addr on one connection.
func roundTrip(t *testing.T, addr string, n int) time.Duration {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	r := bufio.NewReader(c)
	best := time.Hour
	for range n {
		start := time.Now()
		if _, err := c.Write([]byte("ping\n")); err != nil {
			t.Fatal(err)
		}
		line, err := r.ReadString('\n')
		if err != nil || line != "ping\n" {
			t.Fatalf("echo: %q %v", line, err)
		}
		best = min(best, time.Since(start))
	}
	return best
}

func TestProxyAddsItsDelay(t *testing.T) {
	p, addr := startProxy(t, echo(t))
	if rtt := roundTrip(t, addr, 5); rtt > 20*time.Millisecond {
		t.Fatalf("no delay set, yet a round trip took %s", rtt)
	}
	p.SetDelay(Delay{MS: 50, Direction: Upstream})
	rtt := roundTrip(t, addr, 3)
	if rtt < 50*time.Millisecond || rtt > 90*time.Millisecond {
		t.Fatalf("upstream delay 50ms: round trip %s", rtt)
	}
	p.SetDelay(Delay{MS: 40, Direction: Both})
	if rtt := roundTrip(t, addr, 3); rtt < 80*time.Millisecond || rtt > 130*time.Millisecond {
		t.Fatalf("delay 40ms both ways: round trip %s, want ~80ms", rtt)
	}
	p.SetDelay(Delay{MS: 0, Direction: Upstream})
	if rtt := roundTrip(t, addr, 5); rtt > 20*time.Millisecond {
		t.Fatalf("cleared, yet a round trip took %s", rtt)
	}
}

// A delay line keeps throughput: 20 pipelined lines take one delay, not twenty.
func TestProxyDelayIsNotAThrottle(t *testing.T) {
	p, addr := startProxy(t, echo(t))
	p.SetDelay(Delay{MS: 50, JitterMS: 10, Direction: Upstream})
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	start := time.Now()
	go func() {
		for i := range 20 {
			_, _ = c.Write([]byte(strings.Repeat("x", i) + "\n"))
			time.Sleep(time.Millisecond)
		}
	}()
	r := bufio.NewReader(c)
	for i := range 20 {
		line, err := r.ReadString('\n')
		if err != nil || line != strings.Repeat("x", i)+"\n" {
			t.Fatalf("line %d: %q %v (jitter must not reorder data)", i, line, err)
		}
	}
	if took := time.Since(start); took > 200*time.Millisecond {
		t.Fatalf("20 pipelined lines took %s through a 50ms delay line", took)
	}
}

func TestAdminAPI(t *testing.T) {
	p, _ := startProxy(t, echo(t))
	ts := httptest.NewServer(p.AdminHandler())
	defer ts.Close()
	cases := []struct {
		body string
		code int
	}{
		{`{"ms": 50, "jitter_ms": 5}`, 200},
		{`{"ms": -1}`, 400},
		{`{"ms": 5, "jitter_ms": 10}`, 400},
		{`{"ms": 5, "direction": "sideways"}`, 400},
		{`{"ms": 5, "typo": 1}`, 400},
		{`nope`, 400},
	}
	for _, c := range cases {
		resp, err := http.Post(ts.URL+"/_admin/delay", "application/json", strings.NewReader(c.body))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != c.code {
			t.Fatalf("%s: %d, want %d", c.body, resp.StatusCode, c.code)
		}
	}
	if d := p.CurrentDelay(); d.MS != 50 || d.JitterMS != 5 || d.Direction != Upstream {
		t.Fatalf("rejected requests must not change the delay: %+v", d)
	}
}

func TestRunStopsWithContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- Run(ctx, "127.0.0.1:0", echo(t), "127.0.0.1:0", slog.New(slog.NewTextHandler(io.Discard, nil)))
	}()
	time.Sleep(50 * time.Millisecond)
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("Run did not return after its context ended")
	}
}
